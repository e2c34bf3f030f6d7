-- Monthly reports for the cycling club's ride log (SQLite).

-- Distance per member this month, longest first.
select m.name,
       count(r.id) as rides,
       round(sum(r.distance_km), 1) as total_km,
       round(avg(r.avg_speed_kmh), 1) as avg_speed
from members m
join rides r on r.member_id = m.id
where r.started_at >= date('now', 'start of month')
group by m.id
having count(r.id) > 0
order by total_km desc;

-- Members with no ride in the last 60 days.
select m.name, max(r.started_at) as last_ride
from members m
left join rides r on r.member_id = m.id
group by m.id
having last_ride is null
    or last_ride < date('now', '-60 days')
order by last_ride;

-- Routes ridden by at least three members, with their best times.
select rt.name as route,
       count(distinct r.member_id) as riders,
       min(r.duration_min) as best_minutes
from routes rt
join rides r on r.route_id = rt.id
group by rt.id
having count(distinct r.member_id) >= 3
order by riders desc, best_minutes asc
limit 10;

-- Weekly climbing totals for one member (parameter :member).
select strftime('%Y-%W', r.started_at) as week,
       sum(r.elevation_m) as climbed_m,
       case
           when sum(r.elevation_m) >= 3000 then 'mountain goat'
           when sum(r.elevation_m) >= 1000 then 'hill lover'
           else 'flatlander'
       end as badge
from rides r
where r.member_id = :member
group by week
order by week desc;

-- Club records: the longest single ride of each member, ties kept.
select m.name, r.distance_km, r.started_at
from rides r
join members m on m.id = r.member_id
where r.distance_km = (
    select max(r2.distance_km) from rides r2 where r2.member_id = r.member_id
)
order by r.distance_km desc;
