"""The reference scheduler, engines, ``generate`` and the command line."""
