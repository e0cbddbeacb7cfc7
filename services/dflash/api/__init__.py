"""The wire API. `v1` (public) and `internal/v1` (verifier <-> drafter) are generated from protos/ by
`python scripts/gen_protos.py` (or scripts/gen_protos.sh); never edit the generated files by hand."""
