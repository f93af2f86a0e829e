"""Data curation: readers, filters, dedup, decontamination, mixture (knows nothing of the model)."""
