"""CLI subcommands; see attnserve.cli."""
