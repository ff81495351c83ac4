"""What stored KV depends on: one namespace builder for the connector and the native tier."""
