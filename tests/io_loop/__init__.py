"""Tests of io_loop/ (the suite mirrors the code's rooms: tests/README.md)."""
