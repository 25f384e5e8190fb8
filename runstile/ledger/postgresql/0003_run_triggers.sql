-- Migration 3 on PostgreSQL: nothing to do.  SQLite's migration 3 rewrote how its
-- triggers name the terminal statuses (an IN list built a temporary b-tree per row);
-- PostgreSQL's triggers (0001) have no such cost, and their behaviour is the same.
SELECT 1;
