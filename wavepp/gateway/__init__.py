"""The prefill gateway: HTTP and NATS APIs, tenants, fair-share queue, durable intake, router."""
