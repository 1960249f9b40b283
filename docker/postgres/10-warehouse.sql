-- Runs once, when the PostgreSQL volume is first created: the warehouse lives beside the
-- Airflow metadata database on the same server, in a database of its own.
CREATE DATABASE warehouse;
