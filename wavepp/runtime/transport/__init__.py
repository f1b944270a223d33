"""Transports: NATS connection (TLS, credentials), the embedded nats-server, JetStream helpers.

Subject names are not built here: ``wavepp.api.subjects`` owns them.
"""
