"""Numbers as people and models write them (issue 17): ``math_reward("#### .5", "0.5")`` was 0 and
``math_reward("#### .5", "5")`` 1. The whole class: leading-dot decimals, typographic signs, digit-group
separators in text and LaTeX (a comma before exactly three digits; no European decimal commas), percentages
and units after the number, each right and each near miss."""

import pytest

from lit_rl.tasks.rewards import math_reward

CASES = [
    # (completion, gold, reward): the two cases first
    ("#### .5", "0.5", 1.0),
    ("#### .5", "5", 0.0),
    ("#### -.5", "-0.5", 1.0),
    ("The answer is .75", "3/4", 1.0),
    ("\\boxed{.5}", "1/2", 1.0),
    ("#### 0.5", ".5", 1.0),
    # typographic signs
    ("#### \u22123", "-3", 1.0),  # U+2212 MINUS SIGN
    ("#### \u22123", "3", 0.0),
    ("#### \u20137", "-7", 1.0),  # an en dash typed as a minus
    ("\\boxed{\u221212}", "-12", 1.0),
    ("#### \uff0b4", "4", 1.0),  # full-width plus
    ("so 10\u22123 = 7", "7", 1.0),  # subtraction, then the number
    # digit-group separators, plain text and LaTeX
    ("#### 1,234", "1234", 1.0),
    ("#### 1,234,567.89", "1234567.89", 1.0),
    ("#### 1{,}234", "1234", 1.0),
    ("\\boxed{1{,}000{,}000}", "1000000", 1.0),
    ("\\boxed{12\\,345}", "12345", 1.0),
    ("#### 1\u202f234", "1234", 1.0),  # narrow no-break space
    ("We get 1,234 apples in total", "1234", 1.0),
    ("#### 1,234", "1,234", 1.0),
    # a comma not before exactly three digits separates nothing; no European decimal commas
    ("#### 3,5", "3.5", 0.0),
    ("#### 3,5", "35", 0.0),
    ("\\boxed{3,5}", "3.5", 0.0),
    ("\\boxed{1,2345}", "12345", 0.0),
    ("The values are 1, 2, 3", "3", 1.0),
    # percentages
    ("#### 50%", "50", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("#### 12.5 %", "12.5", 1.0),
    # units after the number
    ("#### 18 dollars", "18", 1.0),
    ("\\boxed{18 \\text{ cm}}", "18", 1.0),
    ("\\boxed{5\\,\\text{kg}}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{12 apples.}", "12", 1.0),
    ("#### $1,234.50", "1234.5", 1.0),
    ("\\boxed{\\$18.00}", "18", 1.0),
    # mathematics is not a unit
    ("\\boxed{3x}", "3", 0.0),
    ("\\boxed{2\\pi}", "2", 0.0),
    # what worked before still works
    ("#### 2.50", "2.5", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("#### **42**", "42", 1.0),
]


@pytest.mark.parametrize("completion, gold, reward", CASES)
def test_numbers_as_written(completion, gold, reward):
    assert math_reward(completion, gold) == reward


def test_the_table_is_big_enough():
    assert len(CASES) >= 30
