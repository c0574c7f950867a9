"""draftsmith training: data, features, drafter objectives, trainer, export."""
