"""One session class per protocol: codec commands to engine calls, deliveries to codec replies."""
