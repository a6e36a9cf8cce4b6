"""Tests of io_loop/sinks/ (the suite mirrors the code's rooms: tests/README.md)."""
