"""CLI subcommands that belong to no other part."""
