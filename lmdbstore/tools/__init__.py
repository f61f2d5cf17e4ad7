"""What is done with a store once it exists: verify it, describe it (stats), export or copy it, draw it."""
