"""Tests of io_loop/connectors/ (the suite mirrors the code's rooms: tests/README.md)."""
