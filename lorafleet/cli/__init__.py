"""The `lorafleet` command line. Each module here that defines ``register(subparsers)`` adds
one subcommand (``adapters``, ...); import heavy dependencies inside the handlers, not at
module level, so that every command starts fast."""
