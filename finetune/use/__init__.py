"""Using a trained model: loading it, chat, eval."""
