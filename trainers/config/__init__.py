"""The trainer's configuration: the config tree, its sections and checks, registries, plugins."""
