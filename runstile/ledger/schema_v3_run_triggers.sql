-- Migration 3: the four triggers on runs from schema.sql, unchanged but for how their WHEN
-- clauses name the terminal statuses.
--
-- Why: SQLite evaluates `x IN ('a', 'b', 'c')` (a list of more than two) by first building
-- a temporary b-tree of the list, once per statement; inside a trigger, once per row the
-- trigger fires for.  So an UPDATE that set a live run's status built three of them (one
-- in runs_terminal_is_final, two in runs_active_on_finish), and every admission and every
-- purge one.  Measured (callgrind, SQLite 3.40) on recovery's batch UPDATE of 1,000
-- orphaned runs: 196 M instructions with the IN lists, 107 M without.  A chain of = (or of
-- <>) means the same here, since status is NOT NULL, and builds nothing.
--
-- Bodies and firing events are exactly those of schema.sql; profiles.active_runs stays
-- kept by these triggers alone.

DROP TRIGGER runs_terminal_is_final;
CREATE TRIGGER runs_terminal_is_final BEFORE UPDATE OF status ON runs
WHEN (old.status = 'completed' OR old.status = 'failed' OR old.status = 'cancelled'
      OR old.status = 'interrupted')
     AND new.status IS NOT old.status
BEGIN
    SELECT RAISE(ABORT, 'a terminal run never changes status');
END;

DROP TRIGGER runs_active_on_insert;
CREATE TRIGGER runs_active_on_insert AFTER INSERT ON runs
WHEN new.status <> 'completed' AND new.status <> 'failed' AND new.status <> 'cancelled'
     AND new.status <> 'interrupted'
BEGIN
    UPDATE profiles SET active_runs = active_runs + 1 WHERE id = new.profile_id;
END;

DROP TRIGGER runs_active_on_finish;
CREATE TRIGGER runs_active_on_finish AFTER UPDATE OF status ON runs
WHEN old.status <> 'completed' AND old.status <> 'failed' AND old.status <> 'cancelled'
     AND old.status <> 'interrupted'
     AND (new.status = 'completed' OR new.status = 'failed' OR new.status = 'cancelled'
          OR new.status = 'interrupted')
BEGIN
    UPDATE profiles SET active_runs = active_runs - 1 WHERE id = new.profile_id;
END;

DROP TRIGGER runs_active_on_delete;
CREATE TRIGGER runs_active_on_delete AFTER DELETE ON runs
WHEN old.status <> 'completed' AND old.status <> 'failed' AND old.status <> 'cancelled'
     AND old.status <> 'interrupted'
BEGIN
    UPDATE profiles SET active_runs = active_runs - 1 WHERE id = old.profile_id;
END;
