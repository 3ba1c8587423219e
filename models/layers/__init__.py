"""Building blocks shared by the model classes (plain torch)."""
