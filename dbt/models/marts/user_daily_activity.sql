-- Grain: one row per user and day of event time: the day's payments and their outcome, and the
-- sessions that started that day.
with metrics as (
    select
        user_id,
        to_date(window_start) as day,
        sum(event_count) as payments,
        sum(approved_count) as approved,
        sum(declined_count) as declined,
        sum(amount_sum) as amount
    from {{ source('payments', 'purchase_metrics') }}
    group by user_id, to_date(window_start)
),

sessions as (
    select
        user_id,
        to_date(window_start) as day,
        count(*) as sessions
    from {{ source('logins', 'user_sessions') }}
    group by user_id, to_date(window_start)
)

select
    coalesce(m.user_id, s.user_id) as user_id,
    coalesce(m.day, s.day) as day,
    coalesce(m.payments, 0) as payments,
    coalesce(m.approved, 0) as approved,
    coalesce(m.declined, 0) as declined,
    coalesce(m.amount, cast(0 as decimal(38, 2))) as amount,
    coalesce(s.sessions, 0) as sessions
from metrics as m
full outer join sessions as s
    on m.user_id = s.user_id and m.day = s.day
