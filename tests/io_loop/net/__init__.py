"""Tests of io_loop/net/ (the suite mirrors the code's rooms: tests/README.md)."""
