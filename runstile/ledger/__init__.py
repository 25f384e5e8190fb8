"""The ledger: the single source of truth, and the only place with SQL (docs/architecture.md,
"Packages")."""
