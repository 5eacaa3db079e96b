"""Context parallel runtime."""
