"""Recovery: the boot barrier, journal reconciliation and drain (SPEC §6)."""
