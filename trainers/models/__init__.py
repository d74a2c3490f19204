"""The trainer's models: the registry, closed-form maps and answers, the kernel model, the output contract."""
