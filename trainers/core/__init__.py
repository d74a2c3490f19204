"""What every part of the trainer shares: errors, atomic files, devices, the deadline, progress, heap and pages."""
