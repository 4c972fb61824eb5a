"""Training data: conversation files, the bundled offline generator and SFT samples."""
