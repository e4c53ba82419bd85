"""The `megagate` sub-commands, one module each (`add_arguments(parser)`, `run(args) -> int`); table in megagate.cli."""
