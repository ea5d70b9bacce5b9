"""The ``ppotune`` subcommands that have moved here, one module per command: parsing and orchestration only (the
work is in the packages below: :mod:`tuner.fit`, ...). :mod:`tuner.cli` names each command's module."""
