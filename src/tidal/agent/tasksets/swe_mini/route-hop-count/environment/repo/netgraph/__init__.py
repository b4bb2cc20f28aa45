"""Router network queries."""
