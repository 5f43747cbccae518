"""Tenancy: tenants and their hashed API keys, per-tenant rate limits, idempotency keys."""
