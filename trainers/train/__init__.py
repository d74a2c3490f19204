"""The trainer's training: the loop, one run's epochs, populations, steps, optimisers, regularisers, checkpoints."""
