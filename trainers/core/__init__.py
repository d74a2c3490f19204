"""The trainer's what every part shares: errors, atomic files, devices, the deadline, the progress hook, the heap."""
