"""Test data for kvserve's structured-output tests.

``SCHEMAS`` holds ``(name, user prompt, JSON Schema)`` triples of the
real-world shapes a client of an OpenAI-compatible server sends as
``response_format: {"type": "json_schema", "json_schema": {"name": ...,
"schema": ...}}``: nested objects, arrays of objects, enums, ``anyOf`` /
``oneOf``, ``$ref`` into ``$defs`` (one shallow recursive tree), string
formats (date, date-time, time, email, uuid, uri, ipv4, ipv6, hostname),
``pattern``, bounded numbers and integers (``minimum`` / ``maximum`` /
``exclusiveMinimum``), ``minItems`` / ``maxItems``, ``minLength`` /
``maxLength``, ``const``, nullable fields, booleans, ``required`` with
``additionalProperties: false`` and optional properties.  The prompts are
short instructions a tiny (135M-parameter) chat model sees.

Every schema is bounded so that constrained decoding terminates even when the
model would happily ramble: each free string has ``maxLength`` <= 40 (enum,
const, fixed-width ``pattern`` and the date/time/uuid/ip formats bound
themselves; email and uri carry a ``maxLength`` too), each array a
``maxItems`` <= 4, and the one recursive schema lets every node stop (its
``replies`` are optional).  Property order is the generation order.

Every schema passes ``jsonschema.Draft202012Validator.check_schema`` and
compiles with llguidance (``LLMatcher.grammar_from_json_schema`` with
``{"item_separator": ", ", "key_separator": ": ", "whitespace_flexible":
False}``, then ``validate_grammar_with_warnings`` against the SmolLM2-135M
tokenizer reports no failure).  llguidance 1.9 does not implement
``uniqueItems``, ``not``, ``if``/``then``, ``dependentRequired``, the
``uri-reference`` / ``idn-email`` formats, or ``minProperties`` with optional
keys, so none of these appear.

A caution for tests that check outputs with ``jsonschema``'s
``FORMAT_CHECKER``: llguidance's ``date-time`` (and ``time``) admits second
``60`` at any time of day and a lower-case ``t``/``z``, while that checker
accepts a leap second only at 23:59:60 UTC, so a correctly constrained output
can fail the checker on that format alone.  Validate without the format
checker or tolerate that case.

``INVALID_SCHEMAS`` holds ``(name, schema, word)`` triples that llguidance
refuses (``grammar_from_json_schema`` raises ``ValueError`` or
``validate_grammar_with_warnings`` reports ``failed``); ``word`` occurs in
that error message (compare case-insensitively).
"""

from __future__ import annotations


def _s(max_length: int = 40, min_length: int = 1) -> dict:
    """A free string bounded for a tiny model."""
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    """A closed object; ``required`` defaults to every property, in order."""
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }
    schema.update(extra)
    return schema


_EMAIL = {"type": "string", "format": "email", "maxLength": 40}
_URI = {"type": "string", "format": "uri", "maxLength": 40}
_DATE = {"type": "string", "format": "date"}
_DATETIME = {"type": "string", "format": "date-time"}
_UUID = {"type": "string", "format": "uuid"}
_CURRENCY = {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}
_MONEY = {"type": "number", "minimum": 0, "maximum": 1000000}

_ADDRESS = _obj(
    {
        "street": _s(),
        "city": _s(30),
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
    }
)


SCHEMAS: list[tuple[str, str, dict]] = [
    (
        "person",
        "Describe a person as JSON.",
        _obj(
            {
                "name": _s(),
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": _EMAIL,
                "is_employed": {"type": "boolean"},
            }
        ),
    ),
    (
        "address",
        "Give a postal address as JSON.",
        _ADDRESS,
    ),
    (
        "person_with_address",
        "Describe a person and where they live, as JSON.",
        _obj({"name": _s(), "age": {"type": "integer", "minimum": 0, "maximum": 120}, "address": _ADDRESS}),
    ),
    (
        "product",
        "Describe a product for an online shop as JSON.",
        _obj(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "name": _s(),
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                "currency": _CURRENCY,
                "in_stock": {"type": "boolean"},
                "tags": {"type": "array", "items": _s(15), "maxItems": 4},
            },
            required=["sku", "name", "price", "currency", "in_stock"],
        ),
    ),
    (
        "order_with_line_items",
        "Write an order with its line items as JSON.",
        _obj(
            {
                "order_id": _UUID,
                "customer_email": _EMAIL,
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "product": _s(),
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                            "unit_price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                        }
                    ),
                },
                "total": _MONEY,
                "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
            }
        ),
    ),
    (
        "calendar_event",
        "Create a calendar event as JSON.",
        _obj(
            {
                "title": _s(),
                "start": _DATETIME,
                "end": _DATETIME,
                "location": {"type": ["string", "null"], "maxLength": 40},
                "all_day": {"type": "boolean"},
                "attendees": {"type": "array", "items": _EMAIL, "maxItems": 4},
            }
        ),
    ),
    (
        "github_issue",
        "Write a GitHub issue as JSON.",
        _obj(
            {
                "number": {"type": "integer", "minimum": 1, "maximum": 100000},
                "title": _s(),
                "state": {"type": "string", "enum": ["open", "closed"]},
                "labels": {
                    "type": "array",
                    "maxItems": 4,
                    "items": {"type": "string", "enum": ["bug", "enhancement", "question", "documentation", "good first issue"]},
                },
                "assignee": {"type": ["string", "null"], "pattern": "^[a-z0-9-]{1,20}$"},
                "created_at": _DATETIME,
            }
        ),
    ),
    (
        "weather_report",
        "Report today's weather in a city as JSON.",
        _obj(
            {
                "city": _s(30),
                "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                "humidity_percent": {"type": "integer", "minimum": 0, "maximum": 100},
                "condition": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow", "storm", "fog"]},
                "wind_kph": {"type": "number", "minimum": 0, "maximum": 400},
            }
        ),
    ),
    (
        "recipe",
        "Write a simple recipe as JSON.",
        _obj(
            {
                "title": _s(),
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "prep_minutes": {"type": "integer", "minimum": 0, "maximum": 600},
                "ingredients": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "name": _s(30),
                            "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                            "unit": {"type": "string", "enum": ["g", "kg", "ml", "l", "cup", "tbsp", "tsp", "piece"]},
                        }
                    ),
                },
                "steps": {"type": "array", "minItems": 1, "maxItems": 4, "items": _s()},
            }
        ),
    ),
    (
        "sentiment",
        "Classify the sentiment of 'I love this phone!' as JSON.",
        _obj(
            {
                "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    (
        "named_entities",
        "List the named entities in 'Alice moved to Paris to work at Google.' as JSON.",
        _obj(
            {
                "entities": {
                    "type": "array",
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "text": _s(30),
                            "type": {"type": "string", "enum": ["PERSON", "LOCATION", "ORGANIZATION", "DATE", "OTHER"]},
                        }
                    ),
                }
            }
        ),
    ),
    (
        "sql_query",
        "Describe a SQL query that finds users older than 30, as JSON.",
        _obj(
            {
                "operation": {"type": "string", "enum": ["SELECT", "INSERT", "UPDATE", "DELETE"]},
                "table": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,29}$"},
                "columns": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {"type": "string", "pattern": "^([a-z_][a-z0-9_]{0,29}|\\*)$"},
                },
                "where": {"type": ["string", "null"], "maxLength": 40},
                "limit": {"type": ["integer", "null"], "minimum": 1, "maximum": 1000},
            }
        ),
    ),
    (
        "log_record",
        "Write one application log record as JSON.",
        _obj(
            {
                "timestamp": _DATETIME,
                "level": {"type": "string", "enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
                "logger": _s(30),
                "message": _s(),
                "request_id": _UUID,
            },
            required=["timestamp", "level", "message"],
        ),
    ),
    (
        "bank_transaction",
        "Record a bank transaction as JSON.",
        _obj(
            {
                "id": _UUID,
                "date": _DATE,
                "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000000},
                "currency": _CURRENCY,
                "direction": {"type": "string", "enum": ["debit", "credit"]},
                "counterparty": _s(),
                "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"},
            }
        ),
    ),
    (
        "flight_booking",
        "Book a flight from London to New York as JSON.",
        _obj(
            {
                "booking_ref": {"type": "string", "pattern": "^[A-Z0-9]{6}$"},
                "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "departure": _DATETIME,
                "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]},
                "passengers": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj({"first_name": _s(20), "last_name": _s(20), "seat": {"type": ["string", "null"], "pattern": "^[0-9]{1,2}[A-K]$"}}),
                },
            }
        ),
    ),
    (
        "movie_review",
        "Review a movie you like as JSON.",
        _obj(
            {
                "title": _s(),
                "year": {"type": "integer", "minimum": 1888, "maximum": 2030},
                "rating": {"type": "integer", "minimum": 1, "maximum": 10},
                "summary": _s(),
                "recommended": {"type": "boolean"},
            }
        ),
    ),
    (
        "todo_list",
        "Make a short todo list as JSON.",
        _obj(
            {
                "title": _s(30),
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "task": _s(),
                            "done": {"type": "boolean"},
                            "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                            "due": _DATE,
                        },
                        required=["task", "done"],
                    ),
                },
            }
        ),
    ),
    (
        "geo_point",
        "Give the coordinates of Paris as JSON.",
        _obj(
            {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            }
        ),
    ),
    (
        "invoice",
        "Write an invoice as JSON.",
        {
            "type": "object",
            "$defs": {
                "party": _obj({"name": _s(), "email": _EMAIL, "address": _ADDRESS}),
                "line": _obj(
                    {
                        "description": _s(),
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                        "unit_price": {"type": "number", "minimum": 0, "maximum": 100000},
                    }
                ),
            },
            "properties": {
                "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,8}$"},
                "issue_date": _DATE,
                "due_date": _DATE,
                "seller": {"$ref": "#/$defs/party"},
                "buyer": {"$ref": "#/$defs/party"},
                "lines": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"$ref": "#/$defs/line"}},
                "currency": _CURRENCY,
                "total": _MONEY,
                "paid": {"type": "boolean"},
            },
            "required": ["invoice_number", "issue_date", "due_date", "seller", "buyer", "lines", "currency", "total", "paid"],
            "additionalProperties": False,
        },
    ),
    (
        "user_profile",
        "Create a user profile as JSON.",
        _obj(
            {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                "display_name": _s(30),
                "email": _EMAIL,
                "bio": _s(40, 0),
                "website": _URI,
                "birthday": _DATE,
                "newsletter": {"type": "boolean"},
            },
            required=["username", "email"],
        ),
    ),
    (
        "comment_tree",
        "Write a comment thread with replies as JSON.",
        {
            "$defs": {
                "comment": {
                    "type": "object",
                    "properties": {
                        "author": _s(20),
                        "text": _s(),
                        "replies": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/comment"}},
                    },
                    "required": ["author", "text"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/comment",
        },
    ),
    (
        "contact_method",
        "Give one way to contact support as JSON.",
        _obj(
            {
                "contact": {
                    "oneOf": [
                        _obj({"kind": {"const": "email"}, "address": _EMAIL}),
                        _obj({"kind": {"const": "phone"}, "number": {"type": "string", "pattern": "^\\+[1-9][0-9]{6,14}$"}}),
                        _obj({"kind": {"const": "web"}, "url": _URI}),
                    ]
                }
            }
        ),
    ),
    (
        "payment_method",
        "Describe how an order was paid, as JSON.",
        {
            "anyOf": [
                _obj(
                    {
                        "method": {"const": "card"},
                        "brand": {"type": "string", "enum": ["visa", "mastercard", "amex"]},
                        "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                        "exp_month": {"type": "integer", "minimum": 1, "maximum": 12},
                        "exp_year": {"type": "integer", "minimum": 2024, "maximum": 2040},
                    }
                ),
                _obj({"method": {"const": "bank_transfer"}, "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$"}}),
                _obj({"method": {"const": "cash"}}),
            ]
        },
    ),
    (
        "shape",
        "Describe a geometric shape as JSON.",
        {
            "oneOf": [
                _obj({"shape": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}}),
                _obj(
                    {
                        "shape": {"const": "rectangle"},
                        "width": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                        "height": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                    }
                ),
                _obj(
                    {
                        "shape": {"const": "triangle"},
                        "sides": {
                            "type": "array",
                            "minItems": 3,
                            "maxItems": 3,
                            "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                        },
                    }
                ),
            ]
        },
    ),
    (
        "book",
        "Describe a book as JSON.",
        _obj(
            {
                "title": _s(),
                "authors": {"type": "array", "minItems": 1, "maxItems": 4, "items": _s(30)},
                "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
                "published": _DATE,
                "pages": {"type": "integer", "minimum": 1, "maximum": 5000},
                "genre": {"type": "string", "enum": ["fiction", "non-fiction", "science", "history", "poetry", "children"]},
            }
        ),
    ),
    (
        "company",
        "Describe a company as JSON.",
        _obj(
            {
                "name": _s(),
                "founded": {"type": "integer", "minimum": 1800, "maximum": 2030},
                "employees": {"type": "integer", "minimum": 1, "maximum": 5000000},
                "website": _URI,
                "headquarters": _ADDRESS,
                "public": {"type": "boolean"},
                "ticker": {"type": ["string", "null"], "pattern": "^[A-Z]{1,5}$"},
            }
        ),
    ),
    (
        "server_config",
        "Write a web server configuration as JSON.",
        _obj(
            {
                "hostname": {"type": "string", "format": "hostname", "maxLength": 40},
                "ip": {"type": "string", "format": "ipv4"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "tls": {"type": "boolean"},
                "workers": {"type": "integer", "minimum": 1, "maximum": 64},
                "log_level": {"type": "string", "enum": ["debug", "info", "warn", "error"]},
            }
        ),
    ),
    (
        "network_interface",
        "Describe a network interface as JSON.",
        _obj(
            {
                "name": {"type": "string", "pattern": "^(eth|wlan|en)[0-9]{1,2}$"},
                "mac": {"type": "string", "pattern": "^([0-9a-f]{2}:){5}[0-9a-f]{2}$"},
                "ipv4": {"type": "string", "format": "ipv4"},
                "ipv6": {"type": ["string", "null"], "format": "ipv6"},
                "mtu": {"type": "integer", "minimum": 576, "maximum": 9000},
                "up": {"type": "boolean"},
            }
        ),
    ),
    (
        "http_request",
        "Describe an HTTP request as JSON.",
        _obj(
            {
                "method": {"type": "string", "enum": ["GET", "POST", "PUT", "PATCH", "DELETE"]},
                "url": _URI,
                "headers": {
                    "type": "array",
                    "maxItems": 4,
                    "items": _obj({"name": {"type": "string", "pattern": "^[A-Za-z-]{1,30}$"}, "value": _s()}),
                },
                "body": {"type": ["string", "null"], "maxLength": 40},
                "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 300},
            },
            required=["method", "url"],
        ),
    ),
    (
        "api_error",
        "Return an API error response as JSON.",
        _obj(
            {
                "error": _obj(
                    {
                        "code": {"type": "integer", "minimum": 400, "maximum": 599},
                        "type": {"type": "string", "enum": ["invalid_request", "unauthorized", "not_found", "rate_limited", "server_error"]},
                        "message": _s(),
                        "param": {"type": ["string", "null"], "maxLength": 30},
                    }
                )
            }
        ),
    ),
    (
        "tool_call",
        "Call the get_weather tool for Berlin, as JSON.",
        _obj(
            {
                "name": {"const": "get_weather"},
                "arguments": _obj(
                    {
                        "city": _s(30),
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    required=["city"],
                ),
            }
        ),
    ),
    (
        "yes_no_answer",
        "Is the sky blue? Answer as JSON.",
        _obj({"answer": {"type": "boolean"}, "reason": _s()}),
    ),
    (
        "multiple_choice",
        "What is 2 + 2? Choose A) 3 B) 4 C) 5 D) 22 and answer as JSON.",
        _obj({"choice": {"type": "string", "enum": ["A", "B", "C", "D"]}, "explanation": _s()}),
    ),
    (
        "math_answer",
        "Compute 12 times 7 and answer as JSON.",
        _obj(
            {
                "steps": {"type": "array", "maxItems": 3, "items": _s()},
                "answer": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
            }
        ),
    ),
    (
        "translation",
        "Translate 'good morning' into French and Spanish as JSON.",
        _obj(
            {
                "source": _s(),
                "translations": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj({"language": {"type": "string", "pattern": "^[a-z]{2}$"}, "text": _s()}),
                },
            }
        ),
    ),
    (
        "keywords",
        "Extract up to four keywords from 'fast electric cars are getting cheaper' as JSON.",
        _obj({"keywords": {"type": "array", "minItems": 1, "maxItems": 4, "items": _s(20)}}),
    ),
    (
        "summary",
        "Summarize the story of Cinderella as JSON.",
        _obj(
            {
                "title": _s(),
                "summary": _s(),
                "key_points": {"type": "array", "minItems": 1, "maxItems": 3, "items": _s()},
                "word_count": {"type": "integer", "minimum": 0, "maximum": 100},
            }
        ),
    ),
    (
        "intent_classification",
        "Classify the intent of 'please cancel my subscription' as JSON.",
        _obj(
            {
                "intent": {"type": "string", "enum": ["cancel", "upgrade", "billing_question", "technical_support", "other"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "urgent": {"type": "boolean"},
            }
        ),
    ),
    (
        "spam_check",
        "Is 'You won a free prize, click here' spam? Answer as JSON.",
        _obj(
            {
                "is_spam": {"type": "boolean"},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "reasons": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["prize", "link", "urgency", "unknown_sender", "other"]}},
            }
        ),
    ),
    (
        "employee",
        "Describe an employee record as JSON.",
        _obj(
            {
                "employee_id": {"type": "string", "pattern": "^E[0-9]{5}$"},
                "name": _s(),
                "department": {"type": "string", "enum": ["engineering", "sales", "marketing", "finance", "hr"]},
                "hire_date": _DATE,
                "salary": {"type": "integer", "minimum": 10000, "maximum": 1000000},
                "manager_id": {"type": ["string", "null"], "pattern": "^E[0-9]{5}$"},
                "remote": {"type": "boolean"},
            }
        ),
    ),
    (
        "student_grades",
        "List a student's grades as JSON.",
        _obj(
            {
                "student": _s(30),
                "grades": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "course": _s(30),
                            "score": {"type": "number", "minimum": 0, "maximum": 100},
                            "letter": {"type": "string", "enum": ["A", "B", "C", "D", "F"]},
                        }
                    ),
                },
                "gpa": {"type": "number", "minimum": 0, "maximum": 4},
            }
        ),
    ),
    (
        "medication",
        "Describe a medication prescription as JSON.",
        _obj(
            {
                "drug": _s(30),
                "dose_mg": {"type": "number", "exclusiveMinimum": 0, "maximum": 5000},
                "times_per_day": {"type": "integer", "minimum": 1, "maximum": 6},
                "route": {"type": "string", "enum": ["oral", "topical", "injection", "inhaled"]},
                "start_date": _DATE,
                "notes": {"type": ["string", "null"], "maxLength": 40},
            },
            required=["drug", "dose_mg", "times_per_day", "route"],
        ),
    ),
    (
        "hotel_reservation",
        "Make a hotel reservation as JSON.",
        _obj(
            {
                "hotel": _s(),
                "check_in": _DATE,
                "check_out": _DATE,
                "guests": {"type": "integer", "minimum": 1, "maximum": 8},
                "room_type": {"type": "string", "enum": ["single", "double", "twin", "suite"]},
                "breakfast": {"type": "boolean"},
                "guest_email": _EMAIL,
            }
        ),
    ),
    (
        "car_listing",
        "Describe a used car for sale as JSON.",
        _obj(
            {
                "make": _s(20),
                "model": _s(20),
                "year": {"type": "integer", "minimum": 1950, "maximum": 2030},
                "mileage_km": {"type": "integer", "minimum": 0, "maximum": 1000000},
                "fuel": {"type": "string", "enum": ["petrol", "diesel", "electric", "hybrid"]},
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 500000},
                "vin": {"type": "string", "pattern": "^[A-HJ-NPR-Z0-9]{17}$"},
            }
        ),
    ),
    (
        "real_estate",
        "Describe an apartment for rent as JSON.",
        _obj(
            {
                "address": _ADDRESS,
                "bedrooms": {"type": "integer", "minimum": 0, "maximum": 10},
                "bathrooms": {"type": "number", "minimum": 0, "maximum": 10},
                "area_m2": {"type": "number", "exclusiveMinimum": 0, "maximum": 2000},
                "rent_per_month": _MONEY,
                "pets_allowed": {"type": "boolean"},
                "available_from": _DATE,
            }
        ),
    ),
    (
        "job_posting",
        "Write a job posting as JSON.",
        _obj(
            {
                "title": _s(),
                "company": _s(30),
                "location": _s(30),
                "employment_type": {"type": "string", "enum": ["full-time", "part-time", "contract", "internship"]},
                "salary_range": _obj(
                    {
                        "min": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "max": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "currency": _CURRENCY,
                    }
                ),
                "skills": {"type": "array", "minItems": 1, "maxItems": 4, "items": _s(20)},
                "remote": {"type": "boolean"},
            }
        ),
    ),
    (
        "resume",
        "Write a short resume as JSON.",
        {
            "type": "object",
            "$defs": {
                "job": _obj(
                    {
                        "company": _s(30),
                        "role": _s(30),
                        "start": _DATE,
                        "end": {"anyOf": [_DATE, {"type": "null"}]},
                    }
                ),
                "school": _obj(
                    {
                        "name": _s(),
                        "degree": {"type": "string", "enum": ["high school", "bachelor", "master", "phd"]},
                        "year": {"type": "integer", "minimum": 1950, "maximum": 2030},
                    }
                ),
            },
            "properties": {
                "name": _s(),
                "email": _EMAIL,
                "experience": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/job"}},
                "education": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/school"}},
                "skills": {"type": "array", "maxItems": 4, "items": _s(20)},
            },
            "required": ["name", "email", "experience", "education", "skills"],
            "additionalProperties": False,
        },
    ),
    (
        "playlist",
        "Make a music playlist as JSON.",
        _obj(
            {
                "name": _s(30),
                "public": {"type": "boolean"},
                "tracks": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "title": _s(),
                            "artist": _s(30),
                            "duration_seconds": {"type": "integer", "minimum": 1, "maximum": 3600},
                        }
                    ),
                },
            }
        ),
    ),
    (
        "sports_match",
        "Report the result of a football match as JSON.",
        {
            "type": "object",
            "$defs": {
                "team": _obj({"name": _s(30), "score": {"type": "integer", "minimum": 0, "maximum": 50}}),
            },
            "properties": {
                "date": _DATE,
                "home": {"$ref": "#/$defs/team"},
                "away": {"$ref": "#/$defs/team"},
                "status": {"type": "string", "enum": ["scheduled", "live", "finished", "postponed"]},
                "attendance": {"type": ["integer", "null"], "minimum": 0, "maximum": 200000},
            },
            "required": ["date", "home", "away", "status", "attendance"],
            "additionalProperties": False,
        },
    ),
    (
        "stock_quote",
        "Give a stock quote as JSON.",
        _obj(
            {
                "symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000000},
                "change_percent": {"type": "number", "minimum": -100, "maximum": 1000},
                "volume": {"type": "integer", "minimum": 0, "maximum": 10000000000},
                "as_of": _DATETIME,
            }
        ),
    ),
    (
        "exchange_rate",
        "Give the exchange rate from US dollars to euros as JSON.",
        _obj(
            {
                "base": _CURRENCY,
                "quote": _CURRENCY,
                "rate": {"type": "number", "exclusiveMinimum": 0, "maximum": 100000},
                "date": _DATE,
            }
        ),
    ),
    (
        "nutrition_facts",
        "Give the nutrition facts of an apple as JSON.",
        _obj(
            {
                "food": _s(30),
                "serving_g": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                "calories": {"type": "integer", "minimum": 0, "maximum": 5000},
                "macros": _obj(
                    {
                        "protein_g": {"type": "number", "minimum": 0, "maximum": 1000},
                        "fat_g": {"type": "number", "minimum": 0, "maximum": 1000},
                        "carbs_g": {"type": "number", "minimum": 0, "maximum": 1000},
                    }
                ),
                "vegan": {"type": "boolean"},
            }
        ),
    ),
    (
        "workout",
        "Plan a workout session as JSON.",
        _obj(
            {
                "date": _DATE,
                "exercises": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "name": _s(30),
                            "sets": {"type": "integer", "minimum": 1, "maximum": 10},
                            "reps": {"type": "integer", "minimum": 1, "maximum": 100},
                            "weight_kg": {"type": ["number", "null"], "minimum": 0, "maximum": 500},
                        }
                    ),
                },
                "intensity": {"type": "string", "enum": ["light", "moderate", "hard"]},
            }
        ),
    ),
    (
        "meeting_notes",
        "Write notes from a team meeting as JSON.",
        _obj(
            {
                "date": _DATE,
                "start_time": {"type": "string", "format": "time"},
                "attendees": {"type": "array", "minItems": 1, "maxItems": 4, "items": _s(30)},
                "decisions": {"type": "array", "maxItems": 3, "items": _s()},
                "action_items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": _obj({"owner": _s(30), "task": _s(), "due": _DATE}, required=["owner", "task"]),
                },
            }
        ),
    ),
    (
        "support_ticket",
        "Open a customer support ticket as JSON.",
        _obj(
            {
                "ticket_id": _UUID,
                "customer_email": _EMAIL,
                "subject": _s(),
                "category": {"type": "string", "enum": ["billing", "technical", "account", "other"]},
                "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                "opened_at": _DATETIME,
                "resolved": {"type": "boolean"},
            }
        ),
    ),
    (
        "package_manifest",
        "Describe a software package as JSON.",
        _obj(
            {
                "name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,29}$"},
                "version": {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$"},
                "description": _s(),
                "license": {"type": "string", "enum": ["MIT", "Apache-2.0", "GPL-3.0", "BSD-3-Clause"]},
                "homepage": _URI,
                "dependencies": {
                    "type": "array",
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,29}$"},
                            "version": {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$"},
                        }
                    ),
                },
            },
            required=["name", "version", "license"],
        ),
    ),
    (
        "color_palette",
        "Suggest a color palette as JSON.",
        _obj(
            {
                "name": _s(30),
                "colors": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": _obj({"name": _s(20), "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
                },
            }
        ),
    ),
    (
        "rgb_color",
        "Give the RGB values of orange as JSON.",
        _obj(
            {
                "r": {"type": "integer", "minimum": 0, "maximum": 255},
                "g": {"type": "integer", "minimum": 0, "maximum": 255},
                "b": {"type": "integer", "minimum": 0, "maximum": 255},
                "alpha": {"type": "number", "minimum": 0, "maximum": 1},
            },
            required=["r", "g", "b"],
        ),
    ),
    (
        "bounding_box",
        "Give a bounding box around a detected cat as JSON.",
        _obj(
            {
                "label": {"const": "cat"},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "box": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "integer", "minimum": 0, "maximum": 4096},
                        {"type": "integer", "minimum": 0, "maximum": 4096},
                        {"type": "integer", "minimum": 0, "maximum": 4096},
                        {"type": "integer", "minimum": 0, "maximum": 4096},
                    ],
                    "items": False,
                    "minItems": 4,
                    "maxItems": 4,
                },
            }
        ),
    ),
    (
        "route",
        "Describe a walking route through three places as JSON.",
        {
            "type": "object",
            "$defs": {
                "point": _obj(
                    {
                        "name": _s(30),
                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    }
                ),
            },
            "properties": {
                "name": _s(30),
                "waypoints": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"$ref": "#/$defs/point"}},
                "distance_km": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                "loop": {"type": "boolean"},
            },
            "required": ["name", "waypoints", "distance_km", "loop"],
            "additionalProperties": False,
        },
    ),
    (
        "poll",
        "Create a poll with a question and options as JSON.",
        _obj(
            {
                "question": _s(),
                "options": {"type": "array", "minItems": 2, "maxItems": 4, "items": _s(30)},
                "multiple_answers": {"type": "boolean"},
                "closes_at": {"type": ["string", "null"], "format": "date-time"},
            }
        ),
    ),
    (
        "feature_flag",
        "Describe a feature flag as JSON.",
        _obj(
            {
                "key": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,30}$"},
                "enabled": {"type": "boolean"},
                "rollout_percent": {"type": "integer", "minimum": 0, "maximum": 100},
                "environments": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {"type": "string", "enum": ["dev", "staging", "prod"]},
                },
                "owner_email": _EMAIL,
            }
        ),
    ),
    (
        "git_commit",
        "Describe a git commit as JSON.",
        _obj(
            {
                "sha": {"type": "string", "pattern": "^[0-9a-f]{40}$"},
                "author": _obj({"name": _s(30), "email": _EMAIL}),
                "date": _DATETIME,
                "message": _s(),
                "files_changed": {"type": "integer", "minimum": 0, "maximum": 10000},
                "signed": {"type": "boolean"},
            }
        ),
    ),
    (
        "kubernetes_pod",
        "Describe a Kubernetes pod as JSON.",
        _obj(
            {
                "apiVersion": {"const": "v1"},
                "kind": {"const": "Pod"},
                "metadata": _obj(
                    {
                        "name": {"type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$"},
                        "namespace": {"type": "string", "pattern": "^[a-z0-9-]{1,30}$"},
                    }
                ),
                "spec": _obj(
                    {
                        "containers": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": 2,
                            "items": _obj(
                                {
                                    "name": {"type": "string", "pattern": "^[a-z0-9-]{1,30}$"},
                                    "image": _s(),
                                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                }
                            ),
                        },
                        "restartPolicy": {"type": "string", "enum": ["Always", "OnFailure", "Never"]},
                    }
                ),
            }
        ),
    ),
    (
        "sensor_reading",
        "Report a temperature sensor reading as JSON.",
        _obj(
            {
                "sensor_id": _UUID,
                "timestamp": _DATETIME,
                "value": {"type": "number", "minimum": -50, "maximum": 150},
                "unit": {"const": "celsius"},
                "battery_percent": {"type": ["integer", "null"], "minimum": 0, "maximum": 100},
                "ok": {"type": "boolean"},
            }
        ),
    ),
    (
        "library_loan",
        "Record a library book loan as JSON.",
        _obj(
            {
                "loan_id": _UUID,
                "member": _obj({"name": _s(30), "card_number": {"type": "string", "pattern": "^[0-9]{8}$"}}),
                "book_title": _s(),
                "borrowed": _DATE,
                "due": _DATE,
                "returned": {"anyOf": [_DATE, {"type": "null"}]},
            }
        ),
    ),
    (
        "event_ticket",
        "Issue a concert ticket as JSON.",
        _obj(
            {
                "ticket_id": _UUID,
                "event": _s(),
                "venue": _s(30),
                "starts_at": _DATETIME,
                "seat": _obj(
                    {
                        "section": {"type": "string", "pattern": "^[A-Z]$"},
                        "row": {"type": "integer", "minimum": 1, "maximum": 60},
                        "number": {"type": "integer", "minimum": 1, "maximum": 60},
                    }
                ),
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "vip": {"type": "boolean"},
            }
        ),
    ),
    (
        "pet",
        "Describe a pet as JSON.",
        _obj(
            {
                "name": _s(20),
                "species": {"type": "string", "enum": ["dog", "cat", "bird", "fish", "rabbit", "other"]},
                "age_years": {"type": "number", "minimum": 0, "maximum": 50},
                "vaccinated": {"type": "boolean"},
                "owner": {"type": ["string", "null"], "maxLength": 30},
            }
        ),
    ),
    (
        "plant_care",
        "Give care instructions for a house plant as JSON.",
        _obj(
            {
                "plant": _s(30),
                "light": {"type": "string", "enum": ["low", "medium", "bright indirect", "full sun"]},
                "water_every_days": {"type": "integer", "minimum": 1, "maximum": 60},
                "toxic_to_pets": {"type": "boolean"},
                "tips": {"type": "array", "maxItems": 3, "items": _s()},
            }
        ),
    ),
    (
        "quiz_question",
        "Write a quiz question with four answers as JSON.",
        _obj(
            {
                "question": _s(),
                "answers": {"type": "array", "minItems": 4, "maxItems": 4, "items": _s(30)},
                "correct_index": {"type": "integer", "minimum": 0, "maximum": 3},
                "difficulty": {"type": "string", "enum": ["easy", "medium", "hard"]},
            }
        ),
    ),
    (
        "chat_message",
        "Write a chat message as JSON.",
        _obj(
            {
                "id": _UUID,
                "role": {"type": "string", "enum": ["system", "user", "assistant"]},
                "content": _s(),
                "sent_at": _DATETIME,
                "reply_to": {"type": ["string", "null"], "format": "uuid"},
            },
            required=["id", "role", "content"],
        ),
    ),
    (
        "time_off_request",
        "Request three days of vacation as JSON.",
        _obj(
            {
                "employee": _s(30),
                "type": {"type": "string", "enum": ["vacation", "sick", "parental", "unpaid"]},
                "from": _DATE,
                "to": _DATE,
                "days": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
                "approved": {"type": ["boolean", "null"]},
            }
        ),
    ),
    (
        "country_facts",
        "Give facts about Japan as JSON.",
        _obj(
            {
                "name": _s(30),
                "code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                "capital": _s(30),
                "population": {"type": "integer", "minimum": 0, "maximum": 2000000000},
                "languages": {"type": "array", "minItems": 1, "maxItems": 4, "items": _s(20)},
                "continent": {"type": "string", "enum": ["Africa", "Antarctica", "Asia", "Europe", "North America", "Oceania", "South America"]},
            }
        ),
    ),
    (
        "dns_record",
        "Describe a DNS record as JSON.",
        {
            "oneOf": [
                _obj(
                    {
                        "type": {"const": "A"},
                        "name": {"type": "string", "format": "hostname", "maxLength": 40},
                        "value": {"type": "string", "format": "ipv4"},
                        "ttl": {"type": "integer", "minimum": 60, "maximum": 86400},
                    }
                ),
                _obj(
                    {
                        "type": {"const": "AAAA"},
                        "name": {"type": "string", "format": "hostname", "maxLength": 40},
                        "value": {"type": "string", "format": "ipv6"},
                        "ttl": {"type": "integer", "minimum": 60, "maximum": 86400},
                    }
                ),
                _obj(
                    {
                        "type": {"const": "CNAME"},
                        "name": {"type": "string", "format": "hostname", "maxLength": 40},
                        "value": {"type": "string", "format": "hostname", "maxLength": 40},
                        "ttl": {"type": "integer", "minimum": 60, "maximum": 86400},
                    }
                ),
            ]
        },
    ),
    (
        "shipment_tracking",
        "Give the tracking status of a parcel as JSON.",
        _obj(
            {
                "tracking_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{9}[A-Z]{2}$"},
                "carrier": {"type": "string", "enum": ["UPS", "FedEx", "DHL", "USPS"]},
                "status": {"type": "string", "enum": ["label_created", "in_transit", "out_for_delivery", "delivered", "exception"]},
                "events": {
                    "type": "array",
                    "maxItems": 4,
                    "items": _obj({"at": _DATETIME, "location": _s(30), "description": _s()}),
                },
                "estimated_delivery": {"type": ["string", "null"], "format": "date"},
            }
        ),
    ),
    (
        "survey_response",
        "Answer a customer satisfaction survey as JSON.",
        _obj(
            {
                "respondent_id": _UUID,
                "nps": {"type": "integer", "minimum": 0, "maximum": 10},
                "satisfaction": {"type": "string", "enum": ["very unhappy", "unhappy", "neutral", "happy", "very happy"]},
                "would_recommend": {"type": "boolean"},
                "comment": {"type": ["string", "null"], "maxLength": 40},
            }
        ),
    ),
    (
        "version_only",
        "Give the version of this API as JSON.",
        _obj({"api": {"const": "kvserve"}, "version": {"type": "integer", "minimum": 1, "maximum": 9}}),
    ),
    (
        "string_list",
        "List three fruits as a JSON array.",
        {"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "string", "minLength": 1, "maxLength": 20}},
    ),
    (
        "table_of_people",
        "List up to three people with name and age as a JSON array.",
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": _obj({"name": _s(30), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        },
    ),
]


INVALID_SCHEMAS: list[tuple[str, dict, str]] = [
    ("integer_min_above_max", {"type": "integer", "minimum": 5, "maximum": 1}, "unsatisfiable"),
    ("unknown_type", {"type": "foo"}, "foo"),
    ("string_min_length_above_max", {"type": "string", "minLength": 5, "maxLength": 2}, "unsatisfiable"),
    ("array_min_items_above_max", {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}, "unsatisfiable"),
    ("dangling_ref", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}, "missing"),
    ("unknown_format", {"type": "string", "format": "uri-reference"}, "format"),
    ("unimplemented_keyword", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
]
