"""`dflash bench`: DFlash beside the decoders a user would pick instead, measured in one run."""
