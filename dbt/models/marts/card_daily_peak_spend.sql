-- Grain: one row per card and day of event time: the highest 24-hour spend the card reached that
-- day, and how many times its spend changed.
select
    card_id,
    to_date(as_of) as day,
    max(spend_24h) as peak_spend_24h,
    count(*) as changes
from {{ source('payments', 'rolling_spend') }}
group by card_id, to_date(as_of)
