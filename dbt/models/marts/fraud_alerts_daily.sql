-- Grain: one row per day of event time and kind of alert: how many alerts, about how many subjects
-- (users or cards).
with alerts as (
    select to_date(window_start) as day, 'decline_velocity' as alert, user_id as subject
    from {{ source('fraud', 'decline_alerts') }}
    union all
    select to_date(event_time) as day, 'large_amount' as alert, card_id as subject
    from {{ source('fraud', 'large_amount_alerts') }}
    union all
    select to_date(success_time) as day, 'suspicious_login' as alert, user_id as subject
    from {{ source('fraud', 'suspicious_logins') }}
)

select day, alert, count(*) as alerts, count(distinct subject) as subjects
from alerts
group by day, alert
