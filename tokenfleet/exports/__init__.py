"""The pieces of ``tokenfleet export`` that build training rows (`tokenfleet.export` writes the file)."""
