"""Helpers for tests and demos that must run offline: tiny locally built models."""
