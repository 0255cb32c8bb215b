"""PostgreSQL replication protocol: pure, I/O-free decoders and state machines."""
