"""Synchronous TRL shim over the harbor_async engine (filled by the shim work)."""
