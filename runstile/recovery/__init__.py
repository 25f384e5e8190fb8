"""Recovery: the boot barrier, journal reconciliation and drain (docs/operations.md, "Recovery")."""
