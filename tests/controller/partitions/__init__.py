"""Tests of controller/partitions/ (the suite mirrors the code's rooms: tests/README.md)."""
