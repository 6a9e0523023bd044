"""Executes a plan under torchrun: one handler per plan section; knows nothing about search."""
