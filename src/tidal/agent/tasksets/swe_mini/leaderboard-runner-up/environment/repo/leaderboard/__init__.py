"""Tournament scores and rankings."""
