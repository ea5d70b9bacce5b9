"""The study in its storage: opening it, the search's bookkeeping (lock, heartbeat, resume), the gRPC proxy."""
