"""The ``ppotune`` subcommands, one module per command: parsing and orchestration only (the work is in the
packages below). :mod:`tuner.cli` names each command's module; :mod:`~tuner.commands.flags` holds what every
command spells the same way."""
