"""Tests of controller/lifetime/ (the suite mirrors the code's rooms: tests/README.md)."""
