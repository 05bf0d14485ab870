"""Generated from proto/shardq/v1 by scripts/generate_protos.py; do not edit."""
