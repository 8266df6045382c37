"""Benchmarks: specdec side by side with the peers users would pick instead."""
