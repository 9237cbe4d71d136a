"""Generated from CRIU's images/*.proto by hack/gen-protos.sh; do not edit."""
