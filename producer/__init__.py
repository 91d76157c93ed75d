"""Producer side of tokenfleet: reads dataset sources and enqueues generation tasks."""
