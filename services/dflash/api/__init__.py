"""The wire API. `v1` (public) and `internal/v1` (verifier <-> drafter) are generated from protos/ by
`python -m dflash.api.generate`; never edit the generated files by hand."""
