"""Scheduling: which requests run this step, the waiting queue, the prefill budget."""
